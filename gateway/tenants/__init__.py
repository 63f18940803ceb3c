"""Each tenant's limits in a gateway process: where they come from, how they are enforced,
shared with the other processes, and counted."""
