"""The on-disk format: the manifest, array codecs and dtypes, hashing, encryption."""
