"""Import and export of foreign checkpoint formats, one module per format: ``torch_save``
(torch.save files, and safetensors written through torch), ``dcp``
(torch.distributed.checkpoint), ``tf_native`` (tf.train checkpoints), ``orbax`` and
``orbax_export`` (Orbax), ``npz`` and ``safetensors`` (numpy alone); ``detect`` tells them
apart, ``common`` holds what they share. Each imports only its own framework, when imported:
users reach them through their framework's package (``pitstop.adapters.torch``,
``pitstop.adapters.jax``, ``pitstop.adapters.tf.Checkpoint``) or ``pitstop export`` /
``pitstop import``."""
