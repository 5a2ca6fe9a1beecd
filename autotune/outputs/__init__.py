"""What a sweep leaves the user: the summary, report and recommended configs (report, plots), the DeepSpeed
config in each flavour (dsconfig), the files and instructions for each training stack (handoff), how to launch
them (launch), and MLflow tracking (tracking)."""
