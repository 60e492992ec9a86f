"""Import turboquant before any test module imports mlx, so the fast BLAS is in place
(turboquant/blas.py) exactly as for a user who imports turboquant first."""
import turboquant  # noqa: F401
