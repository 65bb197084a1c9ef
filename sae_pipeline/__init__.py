"""Train and evaluate sparse autoencoders on vision-model token activations."""

__version__ = "0.1.0"
