//! The conformance suite on postgres with the Redis lease layer, and the
//! Redis-loss checks.

agentgate_conformance::suite!(agentgate_conformance::targets::postgres_redis);
agentgate_conformance::redis_suite!(agentgate_conformance::targets::postgres_redis);
agentgate_conformance::server_clock_suite!(agentgate_conformance::targets::postgres_redis);
