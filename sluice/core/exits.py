"""Exit statuses a worker process ends with, which its supervisor reads.

Both sides read them from here: the worker (``sluice.workers``) exits with them and the
executor (``sluice.scheduler``) decides from them whether restarting can help."""

from __future__ import annotations

EXIT_LOAD_FAILED = 3
"""The model did not load: restarting the same configuration will not help."""

EXIT_SLOT_LOST = 4
"""The worker lost its instance slot's lease (another took its place): not a crash."""
