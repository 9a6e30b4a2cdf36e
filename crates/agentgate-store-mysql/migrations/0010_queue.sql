-- agentgate schema v10 (MySQL/MariaDB): a session's queue (on_busy:
-- enqueue and supersede).
--
-- A queued turn is a turn row in state 'queued' with its place in the
-- session's queue in queue_seq (NULL for every other turn; a start of the
-- head clears it). The index serves the head, the length and the
-- positions, all per session. The column is added only when missing (DDL
-- is not transactional), nullable so the previous release's statements
-- still run during a rolling upgrade; but a node of that release knows
-- neither the 'queued' state nor the rule that a queue is never jumped:
-- upgrade every node before any caller enqueues.
--
-- A new request must never jump a queue, so the one-call begins of
-- migrations 0006 and 0009 now also fall back ("decide under the locks of
-- the full path") while the session has a queued turn: they are dropped and
-- created again with that one condition added, in the early check and
-- under the locks, otherwise unchanged.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND column_name = 'queue_seq') = 0,
              'ALTER TABLE ag_turns ADD COLUMN queue_seq BIGINT NULL', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.statistics
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND index_name = 'ag_turns_queue') = 0,
              'CREATE INDEX ag_turns_queue ON ag_turns (session_id, queue_seq)', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
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
       OR EXISTS (SELECT 1 FROM ag_turns WHERE session_id = p_session_id
                      AND queue_seq IS NOT NULL)
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
           + (SELECT COUNT(*) FROM ag_turns WHERE session_id = p_session_id
                AND queue_seq IS NOT NULL)
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
       OR EXISTS (SELECT 1 FROM ag_turns WHERE session_id = p_session_id
                      AND queue_seq IS NOT NULL)
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
           + (SELECT COUNT(*) FROM ag_turns WHERE session_id = p_session_id
                AND queue_seq IS NOT NULL)
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
