-- agentgate schema v9 (MySQL/MariaDB): the layered begin's common grant in
-- one CALL.
--
-- With a lease layer (Redis) a begin decides on a snapshot, takes a fence
-- from the counter (its own autocommit statement), acquires the layer's
-- lease and permit with it, and only then writes the grant
-- (agentgate-store-sql's begin::layered). ag_begin_layered writes that
-- grant for a NEW turn (attempt 1) when, read under the full path's locks
-- in its order (the user's row, then the session's row, each created on
-- first use), the start the caller decided still holds: the request has no
-- turn yet, the session belongs to the caller, names no holder and no
-- pending confirmation, and its newest fence is below the one the layer's
-- lease was taken with, and the cap is in range and not reached in the
-- rows (which keep no expiry under a lease layer). It selects 1 when it
-- wrote the grant, or 0 ("fall back"), having rolled back: the caller then
-- decides again under the locks of the full path. It never refuses by
-- itself. The caller never calls it with a confirmation, and only with a
-- lease layer; src/begin.rs maps each condition to decide_begin's answer.
--
-- The isolation level, the lock order, the clock and the error handling
-- are ag_begin_fast's (migration 0006, which explains each); the grant
-- differs in two columns: the fence is the caller's, and the session row
-- keeps no expiry (the layer is the authority on liveness). Idempotent if a
-- node dies halfway: dropped, then created.
DROP PROCEDURE IF EXISTS ag_begin_layered;
CREATE PROCEDURE ag_begin_layered(
    IN p_user_id           VARBINARY(512),
    IN p_session_id        VARBINARY(512),
    IN p_client_request_id VARBINARY(512),
    IN p_turn_id           VARBINARY(512),
    IN p_fingerprint       CHAR(64) CHARACTER SET ascii COLLATE ascii_bin,
    IN p_payload           MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_token_hash        CHAR(64) CHARACTER SET ascii COLLATE ascii_bin,
    IN p_fence             BIGINT,
    IN p_default_cap       BIGINT)
main: BEGIN
    DECLARE v_session_user VARBINARY(512);
    DECLARE v_holder VARBINARY(512);
    DECLARE v_pending VARBINARY(512);
    DECLARE v_session_fence BIGINT;
    DECLARE v_now BIGINT;
    DECLARE v_cap BIGINT;
    DECLARE v_live BIGINT;
    DECLARE v_turn_exists BIGINT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;
    -- Ruled out by the rows without a lock: fall back at once.
    IF EXISTS (SELECT 1 FROM ag_turns WHERE session_id = p_session_id
                   AND client_request_id = p_client_request_id)
       OR EXISTS (SELECT 1 FROM ag_sessions WHERE session_id = p_session_id
                      AND (holder_turn_id IS NOT NULL OR fence >= p_fence)) THEN
        SELECT 0 AS written;
        LEAVE main;
    END IF;
    SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
    START TRANSACTION;
    INSERT INTO ag_users (user_id) VALUES (p_user_id)
        ON DUPLICATE KEY UPDATE max_turns = max_turns;
    INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms)
        VALUES (p_session_id, p_user_id, 0,
                (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000))
        ON DUPLICATE KEY UPDATE user_id = user_id;
    SELECT user_id, holder_turn_id, pending_turn_id, fence
        INTO v_session_user, v_holder, v_pending, v_session_fence
        FROM ag_sessions WHERE session_id = p_session_id FOR UPDATE;
    SELECT (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000),
           (SELECT max_turns FROM ag_users WHERE user_id = p_user_id),
           (SELECT COUNT(*) FROM ag_sessions WHERE user_id = p_user_id
                AND lease_expires_at_ms >
                    (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)),
           (SELECT COUNT(*) FROM ag_turns WHERE session_id = p_session_id
                AND client_request_id = p_client_request_id)
        INTO v_now, v_cap, v_live, v_turn_exists;
    SET v_cap = COALESCE(v_cap, p_default_cap);
    IF NOT (v_session_user = p_user_id
            AND v_holder IS NULL
            AND v_pending IS NULL
            AND v_session_fence < p_fence
            AND v_turn_exists = 0
            AND v_cap BETWEEN 0 AND 4294967295
            AND v_live < v_cap) THEN
        ROLLBACK;
        SELECT 0 AS written;
        LEAVE main;
    END IF;
    UPDATE ag_sessions SET holder_turn_id = p_turn_id, lease_token_hash = p_token_hash,
           fence = p_fence, lease_expires_at_ms = NULL, updated_at_ms = v_now
        WHERE session_id = p_session_id;
    INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint,
           state, attempt, fence, created_at_ms, updated_at_ms, payload)
        VALUES (p_turn_id, p_session_id, p_user_id, p_client_request_id, p_fingerprint,
           'running', 1, p_fence, v_now, v_now, p_payload);
    COMMIT;
    SELECT 1 AS written;
END;
