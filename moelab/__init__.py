"""moelab: reproduce, measure and reuse the techniques of sparse MoE models with long context."""

__version__ = "0.1.0"
