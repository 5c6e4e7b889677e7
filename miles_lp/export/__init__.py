"""From a learner to an engine: engine tensor naming/encoding, export groups, engine checkpoints.

    from miles_lp.export import naming           # target x format -> on-disk tensor names, dtypes, encode

One module owns engine naming (``naming``), used by ``miles-lp convert``, ``miles-lp export`` and the live
weight sync, so a converted checkpoint and a synchronized engine hold the same tensors under the same names.
"""
