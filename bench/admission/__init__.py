"""Admission-control benchmark on a live mock mesh (see run.py)."""
