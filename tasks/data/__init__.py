"""What comes from outside: corpus sources and their token stream, the embedded default, the MLflow registry."""
