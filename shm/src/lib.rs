//! placeholder, replaced by the shm issue
