"""Values: small typed frozen values, errors and checks (pure: never imports jax)."""
