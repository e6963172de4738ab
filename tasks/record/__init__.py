"""What an audit leaves: its record, the verdict, the spool, MLflow runs, the report and its plots. It never imports ``tasks.models``."""
