-- agentgate schema v8 (MySQL/MariaDB): a turn can be asked to stop. The
-- request is recorded on the turn (store-clock ms), without a lease token;
-- the holder learns it on its next heartbeat and tool claim, and ends the
-- turn `cancelled`. NULL: no request. The column is added only when
-- missing (DDL is not transactional), nullable so a node of the previous
-- release keeps writing turns during a rolling upgrade.
--
-- The ending procedure of v6 returns the turn's row by position in the
-- crate's TURN_COLUMNS, which now ends with the new column: it is dropped
-- and created again with it, unchanged otherwise.
SET @ddl = IF((SELECT COUNT(*) FROM information_schema.columns
               WHERE table_schema = DATABASE() AND table_name = 'ag_turns'
                 AND column_name = 'cancel_requested_at_ms') = 0,
              'ALTER TABLE ag_turns ADD COLUMN cancel_requested_at_ms BIGINT NULL', 'DO 0');
PREPARE ag_ddl FROM @ddl;
EXECUTE ag_ddl;
DEALLOCATE PREPARE ag_ddl;
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
               decision, confirmed_by, created_at_ms, updated_at_ms, cancel_requested_at_ms
            FROM ag_turns WHERE turn_id = p_turn_id;
        COMMIT;
    END IF;
END;
