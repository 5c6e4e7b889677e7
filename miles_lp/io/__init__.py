"""File I/O every stage shares, below the converter and the learners: safetensors shards and indexes
(``safetensors_io``), output folders that appear whole or not at all (``atomic``), and the validation of a
Hugging Face checkpoint folder (``validate``)."""
