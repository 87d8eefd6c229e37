"""Where a run's bytes live: the run-directory map (every file and folder of `run.dir`), local and
object-store storage behind one interface, the one append-only log type, the lock and lease that let
one trainer write at a time, and the bound on every storage call. Nothing here knows about models or
prompts; every other wing asks this one for paths and writes."""
