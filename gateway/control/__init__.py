"""The gateway's view of the control plane: the catalog and its refresh, model control,
routes' labels and splits, and what the health, metadata and settings endpoints answer."""
