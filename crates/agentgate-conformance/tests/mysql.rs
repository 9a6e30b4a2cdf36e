//! The conformance suite on mysql, and the checks that need a server clock.

agentgate_conformance::suite!(agentgate_conformance::targets::mysql);
agentgate_conformance::server_clock_suite!(agentgate_conformance::targets::mysql);
