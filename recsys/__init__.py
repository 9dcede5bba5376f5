"""Entry points and the ML side: data, models, metrics, the train loop and launch."""
