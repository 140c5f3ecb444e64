"""The on-disk format: the manifest (``schema`` its data, ``encode`` and ``seal`` its writing,
``validate`` and ``entries`` its checked reading, ``decoding`` the strict JSON under both),
array ``codecs`` and ``dtypes``, ``hashing``, and encryption (``crypto``)."""
