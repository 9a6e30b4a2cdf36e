-- agentgate schema v6 (MySQL/MariaDB): the one-round-trip fast paths of a
-- begin and of a turn's ending, as stored procedures (`src/fast.rs` and
-- `src/begin.rs` say when they are called and why their answers are
-- decide's). Each is called with one `CALL` in autocommit and runs its own
-- transaction: it commits only the common case and otherwise rolls back,
-- writing nothing, and tells the caller to run the full read-decide-write
-- path. An error rolls back before it is raised again, so no connection
-- goes back to the pool inside a transaction.
--
-- The clock expression is the crate's NOW_MS. Parameters that hold text
-- carry the columns' character sets, so nothing is converted on the way.
-- Idempotent if a node dies halfway: each procedure is dropped, then
-- created. Needs CREATE ROUTINE and ALTER ROUTINE; callers need EXECUTE.
DROP PROCEDURE IF EXISTS ag_begin_fast;
CREATE PROCEDURE ag_begin_fast(
    IN p_user_id           VARBINARY(512),
    IN p_session_id        VARBINARY(512),
    IN p_client_request_id VARBINARY(512),
    IN p_turn_id           VARBINARY(512),
    IN p_fingerprint       CHAR(64) CHARACTER SET ascii COLLATE ascii_bin,
    IN p_payload           MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_token_hash        CHAR(64) CHARACTER SET ascii COLLATE ascii_bin,
    IN p_ttl_ms            BIGINT,
    IN p_default_cap       BIGINT)
main: BEGIN
    DECLARE v_session_user VARBINARY(512);
    DECLARE v_holder VARBINARY(512);
    DECLARE v_pending VARBINARY(512);
    DECLARE v_pending_expires BIGINT;
    DECLARE v_now BIGINT;
    DECLARE v_cap BIGINT;
    DECLARE v_live BIGINT;
    DECLARE v_turn_exists BIGINT;
    DECLARE v_fence BIGINT DEFAULT NULL;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;
    -- Declining is always safe, so a request whose turn is already recorded
    -- (a repeat, a duplicate storm) or a session already held declines
    -- before taking any lock, instead of queueing on the user's and the
    -- session's row locks twice (here, then on the full path). A stale
    -- read here only lets the case through to the checks under the locks.
    IF EXISTS (SELECT 1 FROM ag_turns WHERE session_id = p_session_id
                   AND client_request_id = p_client_request_id)
       OR EXISTS (SELECT 1 FROM ag_sessions WHERE session_id = p_session_id
                      AND holder_turn_id IS NOT NULL) THEN
        SELECT v_fence AS fence;
        LEAVE main;
    END IF;
    -- READ COMMITTED as on every pooled connection, said here again so the
    -- procedure's reads never depend on the caller's session: each
    -- consistent read takes a fresh snapshot, so the facts read after the
    -- locks see every grant committed before them (MariaDB and MySQL
    -- manuals, "READ COMMITTED"/"Consistent Nonlocking Reads"). The clock is
    -- read per statement inside a procedure, like a statement's own.
    SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
    START TRANSACTION;
    -- The locks of the full path, in its order: the user's row, then the
    -- session's row (each created on first use), the fence counter last.
    INSERT INTO ag_users (user_id) VALUES (p_user_id)
        ON DUPLICATE KEY UPDATE max_turns = max_turns;
    INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms)
        VALUES (p_session_id, p_user_id, 0,
                (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000))
        ON DUPLICATE KEY UPDATE user_id = user_id;
    SELECT user_id, holder_turn_id, pending_turn_id, pending_expires_at_ms
        INTO v_session_user, v_holder, v_pending, v_pending_expires
        FROM ag_sessions WHERE session_id = p_session_id FOR UPDATE;
    -- The facts, read after the locks (a fresh snapshot per statement at
    -- READ COMMITTED), in one statement so they share one clock reading.
    SELECT (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000),
           (SELECT max_turns FROM ag_users WHERE user_id = p_user_id),
           (SELECT COUNT(*) FROM ag_sessions WHERE user_id = p_user_id
                AND lease_expires_at_ms >
                    (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)),
           (SELECT COUNT(*) FROM ag_turns WHERE session_id = p_session_id
                AND client_request_id = p_client_request_id)
        INTO v_now, v_cap, v_live, v_turn_exists;
    SET v_cap = COALESCE(v_cap, p_default_cap);
    IF v_session_user = p_user_id
       AND v_holder IS NULL
       AND (v_pending IS NULL OR v_pending_expires IS NULL OR v_pending_expires <= v_now)
       AND v_turn_exists = 0
       AND v_cap BETWEEN 0 AND 4294967295
       AND v_live < v_cap THEN
        UPDATE ag_fence SET value = value + 1 WHERE id = 1;
        IF ROW_COUNT() = 1 THEN
            SELECT value INTO v_fence FROM ag_fence WHERE id = 1;
        END IF;
    END IF;
    IF v_fence IS NULL THEN
        ROLLBACK;
    ELSE
        UPDATE ag_sessions SET holder_turn_id = p_turn_id, lease_token_hash = p_token_hash,
               fence = v_fence, lease_expires_at_ms = v_now + p_ttl_ms, updated_at_ms = v_now
            WHERE session_id = p_session_id;
        INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint,
               state, attempt, fence, created_at_ms, updated_at_ms, payload)
            VALUES (p_turn_id, p_session_id, p_user_id, p_client_request_id, p_fingerprint,
               'running', 1, v_fence, v_now, v_now, p_payload);
        COMMIT;
    END IF;
    -- NULL: nothing was written, run the full path.
    SELECT v_fence AS fence;
END;

DROP PROCEDURE IF EXISTS ag_end_turn_fast;
CREATE PROCEDURE ag_end_turn_fast(
    IN p_turn_id             VARBINARY(512),
    IN p_token_hash          CHAR(64) CHARACTER SET ascii COLLATE ascii_bin,
    IN p_state               VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin,
    IN p_response            MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_error               MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_retryable           BOOLEAN,
    IN p_pending             MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    IN p_confirmation_ttl_ms BIGINT)
BEGIN
    DECLARE v_session VARBINARY(512) DEFAULT NULL;
    DECLARE v_fence BIGINT;
    DECLARE v_now BIGINT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;
    -- No such live lease: the locking read finds no row, v_session stays NULL.
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_session = NULL;
    SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
    START TRANSACTION;
    -- The session's row first, as every step locks it (the turn is found by
    -- a subquery, which does not lock), with the lease check of the full
    -- path: this turn the holder, this token, unexpired on the server clock.
    SELECT s.session_id, s.fence,
           (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)
        INTO v_session, v_fence, v_now
        FROM ag_sessions s
        WHERE s.session_id = (SELECT session_id FROM ag_turns WHERE turn_id = p_turn_id)
          AND s.holder_turn_id = p_turn_id AND s.lease_token_hash = p_token_hash
          AND s.lease_expires_at_ms >
              (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)
        FOR UPDATE;
    IF v_session IS NOT NULL THEN
        UPDATE ag_turns SET state = p_state, response = p_response, error = p_error,
               retryable = p_retryable, pending = COALESCE(p_pending, pending),
               updated_at_ms = v_now, ended_at_ms = v_now
            WHERE turn_id = p_turn_id AND state = 'running' AND fence = v_fence;
        IF ROW_COUNT() <> 1 THEN
            SET v_session = NULL;
        END IF;
    END IF;
    IF v_session IS NULL THEN
        -- Nothing written and no row answered: run the full path.
        ROLLBACK;
    ELSE
        UPDATE ag_sessions SET holder_turn_id = NULL, lease_token_hash = NULL,
               lease_expires_at_ms = NULL, updated_at_ms = v_now,
               pending_turn_id = IF(p_pending IS NULL, pending_turn_id, p_turn_id),
               pending_expires_at_ms = IF(p_pending IS NULL, pending_expires_at_ms,
                                          v_now + p_confirmation_ttl_ms)
            WHERE session_id = v_session;
        -- The view as this transaction wrote it, before the commit: a read
        -- after it could see a begin that restarted the turn meanwhile.
        SELECT turn_id, session_id, user_id, client_request_id, fingerprint, state, attempt,
               fence, response, error, retryable, pending, confirms_turn_id, confirms_pending,
               decision, confirmed_by, created_at_ms, updated_at_ms
            FROM ag_turns WHERE turn_id = p_turn_id;
        COMMIT;
    END IF;
END;
