"""Object storage, the only package that talks to fsspec: everything else passes URLs and keys.

`location` is a store or a catalogue (containment, reads, atomic writes, listing), `conditional` its
compare-and-swap writes, `credentials` where its secrets come from, `faults` which of its failures are of the
moment, `cache` local copies of its objects. Callers import the names below from `imgest.storage`.
"""

from imgest.storage.location import (
    MAX_RECORD_BYTES,
    TEMP_PREFIX,
    USERINFO,
    ContainmentError,
    Location,
    ObjectInfo,
    RecordError,
    StorageError,
    check_no_credentials,
    is_transient,
    one_line,
    open_location,
    parquet_reader,
    parse_record,
    read_url,
    redact,
)

__all__ = ["MAX_RECORD_BYTES", "TEMP_PREFIX", "USERINFO", "ContainmentError", "Location", "ObjectInfo", "RecordError",
           "StorageError", "check_no_credentials", "is_transient", "one_line", "open_location", "parquet_reader",
           "parse_record",
           "read_url", "redact"]
