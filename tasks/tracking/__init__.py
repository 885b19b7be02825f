"""MLflow tracking, the delivered policy as an MLflow model, the learning curve, and progress."""
