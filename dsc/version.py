"""The version of dsc (a leaf: the compiler records it without importing the package's API).

A partial build records the version that began it and only that version resumes it: bump it
whenever a build's plan gains a key or its records could come out otherwise (0.2.0: `alpha`;
0.3.0: format 1.2, decoder warnings in the journal, simplejpeg where the system libjpeg-turbo is
missing; 0.4.0: format 1.3 (checksums.bin, versions), archive sources and their plan keys; 0.5.0:
format 1.4 (shard tables), builds into a bucket; 0.6.0: format 1.5 (the index in segments)), so an
older dsc never resumes a newer plan, nor a newer one an older build.
"""

__version__ = "0.6.0"
