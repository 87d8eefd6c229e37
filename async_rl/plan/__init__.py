"""Planning without the hardware: the chip table (TPU and GPU), compiling a run's learner and engine for
a TPU topology or a GPU description ahead of time, and the memory estimate that says whether a config
fits a host and its chips."""
