"""``python -m sluice.batch``: one batch worker (settings from SLUICE_* variables)."""

from __future__ import annotations

import sys

from sluice.batch.app import run_worker
from sluice.core.observability.logs import configure_logging
from sluice.core.settings import BatchSettings, settings_at_start


def main() -> int:
    settings = settings_at_start(BatchSettings)
    configure_logging("batch", settings)
    return run_worker(settings)


if __name__ == "__main__":
    sys.exit(main())
