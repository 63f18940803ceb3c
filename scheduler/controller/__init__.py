"""The controller: one leads through a Redis lease and decides (autoscaling, rollouts, poll
mode); the executors carry its fenced decisions out."""
