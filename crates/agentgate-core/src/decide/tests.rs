//! Unit tests of the pure decisions.
