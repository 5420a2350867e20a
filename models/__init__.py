"""Model definitions, small trainable models and bundled traces (installed as prophet_jax.models)."""
