//! The conformance suite on mysql with the Redis lease layer, and the
//! Redis-loss checks.

agentgate_conformance::suite!(agentgate_conformance::targets::mysql_redis);
agentgate_conformance::redis_suite!(agentgate_conformance::targets::mysql_redis);
agentgate_conformance::server_clock_suite!(agentgate_conformance::targets::mysql_redis);
