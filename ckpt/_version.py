"""The version of this package, recorded in every manifest it writes (``versions.ckpt``)."""

__version__ = "0.1.0"
