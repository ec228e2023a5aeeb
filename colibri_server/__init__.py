"""colibri-server: a CPU inference server for Mixture-of-Experts language models."""
__version__ = "0.1.0"
