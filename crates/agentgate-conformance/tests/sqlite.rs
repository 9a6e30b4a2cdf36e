//! The conformance suite on embedded SQLite.

agentgate_conformance::suite!(agentgate_conformance::targets::sqlite);
