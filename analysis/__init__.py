"""Reading finished runs: aggregate evaluations, statistics over seeds, offline-run diagnostics, plots and
reports.  This layer sits above starting a run (``training``) and is never imported by it."""
