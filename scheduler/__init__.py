"""Control plane, in three rooms: :mod:`.repository` (where the models come from),
:mod:`.executor` (``sluice up``: processes on this machine, or Deployments on Kubernetes)
and :mod:`.controller` (what should run: autoscaling, rollouts, poll mode).

Imports go one way: the executor may use the controller and the repository, the
controller the repository, the repository neither."""
