"""The book's figures: one style (``style``), one module of plotting functions per topic.

Every widget wraps a pure ``plot_*`` function that returns a matplotlib figure.
"""
from .bitaxon import plot_swa_budget, plot_window_memory
from .cache import best_within, lower_edge, plot_cache_tradeoff, plot_loadtest
from .diagrams import plot_chapter_map, plot_nibble_lookup, plot_pipeline, plot_polar_tree
from .calibrated import plot_allocation, plot_budget_choice, plot_spectra
from .fibquant import plot_fibquant_codebook, plot_frontier, plot_radius_law
from .inner import plot_qjl_estimates, qjl_estimates
from .memory import MACBOOK_AIR_BYTES, plot_kv_calculator, plot_kv_memory
from .performance import plot_decode_speedups, plot_roofline, plot_step_bytes
from .polar import plot_polar_angles
from .realmodel import (plot_key_channels, plot_layer_heatmap, plot_needle_grid, plot_needle_reading, plot_ppl_frontier, plot_value_noise, plot_sink_mass,
                        plot_window_increases)
from .scalar import plot_codebook, plot_rate_distortion
from .sphere import plot_block_law, plot_coordinate_law, plot_rotation_effect
from .style import COLORS, GB, MB, Table, below, figure, interact, table

__all__ = ["COLORS", "GB", "MB", "Table", "below", "figure", "interact", "table", "plot_kv_memory", "plot_loadtest",
           "plot_kv_calculator", "MACBOOK_AIR_BYTES",
           "plot_rotation_effect", "plot_coordinate_law", "plot_block_law", "plot_codebook",
           "plot_rate_distortion", "plot_qjl_estimates", "qjl_estimates", "plot_polar_angles",
           "plot_radius_law", "plot_fibquant_codebook", "plot_frontier", "plot_swa_budget",
           "plot_ppl_frontier", "plot_needle_grid", "plot_needle_reading", "plot_value_noise", "plot_key_channels", "plot_layer_heatmap", "plot_sink_mass", "plot_window_increases",
           "plot_spectra", "plot_allocation",
           "plot_budget_choice", "plot_step_bytes", "plot_roofline", "plot_decode_speedups",
           "plot_window_memory", "plot_cache_tradeoff", "best_within", "lower_edge",
           "plot_pipeline", "plot_chapter_map", "plot_polar_tree", "plot_nibble_lookup"]
