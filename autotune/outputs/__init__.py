"""What a sweep leaves the user: the summary, report and recommended configs (report, plots), the files and
instructions for each training stack (handoff), how to launch them (launch), and MLflow tracking (tracking)."""
