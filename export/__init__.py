"""Personalised model -> ONNX and ExecuTorch .pte, with parity checks; ExecuTorch training programs.

Modules (each imports its optional dependency only when called):

- :mod:`export.deps`: the optional dependencies and the extra that installs each one.
- :mod:`export.inputs`: sample inputs and dynamic shapes for a :class:`~flayer.models.ModelSpec`.
- :mod:`export.onnx_export`: ``torch.onnx.export`` (dynamo, dynamic batch, one self-contained file)
  and an onnxruntime runner.
- :mod:`export.pte_export`: ``to_edge_transform_and_lower`` with the XNNPACK partitioner and an
  ExecuTorch runtime runner.
- :mod:`export.verify`: max-abs-difference parity and latency per sample.
- :mod:`export.pipeline`: the whole ``flayer export`` job for one model file.
- :mod:`export.et_training`: which models the ExecuTorch training path supports, and the joint
  forward/backward program.
- :mod:`export.et_round`: a local round (SGD, per-group learning rates) run through that program.
"""
