"""Redis clients as Sluice makes them: from the URL (one Redis or a Cluster), commands
written at once, commands coalesced, and precise reply types."""
