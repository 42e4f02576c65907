//! ZMQ ingest.
