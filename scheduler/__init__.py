"""Control plane: repository reading into the catalog, worker supervision, ``sluice up``."""
