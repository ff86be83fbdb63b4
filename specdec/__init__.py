"""specdec: exact speculative decoding, exported to ONNX and run on ONNX Runtime.

Subpackages: ``specdec.export`` (HF models -> bundle; needs the ``[export]`` extra),
``specdec.engines`` (graphs over bound buffers), ``specdec.runtime`` (decoding; NumPy only
plus ONNX Runtime). Importing this package imports none of them.
"""

__version__ = "0.1.0"
