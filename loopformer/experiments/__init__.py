"""Experiments: orchestration above training and evaluation — sweeps of runs (`sweep`), their tables and plots in
the layout of the paper's Table 2 (`report`), and the CPU reproduction (`demo`)."""
