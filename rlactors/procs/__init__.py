"""The procs' lives: where they run (placement, Slurm), how they are watched (liveness pings and
pidfds, Monarch's supervision settings) and the controller loop's watchdog."""
