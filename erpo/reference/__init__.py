"""The cached reference ell_theta0(q) and w(q) (paper appendix C): the cache itself (`cache`), the identities it
records (`fingerprint`), a run's path for it, checked from the config alone (`cache_path`), and building or loading
it for a run (`setup`)."""
