//! The conformance suite on postgres, and the checks that need a server clock.

agentgate_conformance::suite!(agentgate_conformance::targets::postgres);
agentgate_conformance::server_clock_suite!(agentgate_conformance::targets::postgres);
