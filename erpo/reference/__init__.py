"""The cached reference ell_theta0(q) and w(q) (paper appendix C): the cache itself (`cache`), the identities it
records (`fingerprint`), and building or loading it for a run (`setup`)."""
