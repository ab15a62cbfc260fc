"""Predicting full-size peaks on a CPU: fake-tensor traces, closed-form model states, calibration."""
