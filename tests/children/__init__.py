"""Programs the tests run in child processes (one module each): where a crash, device flags set
before jax is imported, or several processes must stay out of the pytest process."""
