-- agentgate schema v9 (PostgreSQL): the layered begin's common grant in one
-- statement.
--
-- With a lease layer (Redis) a begin decides on a snapshot, takes a fence
-- from the sequence, acquires the layer's lease and permit with it, and
-- only then writes the grant (agentgate-store-sql's begin::layered).
-- ag_begin_layered writes that grant for a NEW turn (attempt 1) when, read
-- under the begin's locks, the start the caller decided still holds: the
-- request has no turn yet, the session is free (no holder named, no pending
-- confirmation), belongs to the caller or does not exist yet, its newest
-- fence is below the one the layer's lease was taken with, and the cap is
-- in range and not reached in the rows (which keep no expiry under a lease
-- layer, so only a cap of 0 is reached). It returns TRUE when it wrote the
-- grant, or FALSE ("fall back"): the caller then decides again under the
-- locks of the full path. It never refuses by itself, and a FALSE answer has
-- written nothing. The caller never calls it with a confirmation, and only
-- with a lease layer; src/begin.rs maps each condition to decide_begin's
-- answer.
--
-- Locks, snapshots, the clock and the clean-up of a first use's rows are
-- ag_begin_new's (migration 0006, which explains each); the grant differs in
-- two columns: the fence is the caller's, and the session row keeps no
-- expiry (the layer is the authority on liveness).
--
-- Parameters: the session, user and request ids; the new turn's id, the
-- lease token's digest, the request's fingerprint and payload; the fence the
-- layer's lease was acquired with; the configured cap (for a user row
-- without its own); the step's lock timeout.
CREATE FUNCTION ag_begin_layered(
    p_session_id TEXT,
    p_user_id TEXT,
    p_client_request_id TEXT,
    p_turn_id TEXT,
    p_token_hash TEXT,
    p_fingerprint TEXT,
    p_payload TEXT,
    p_fence BIGINT,
    p_default_cap BIGINT,
    p_lock_timeout TEXT
) RETURNS BOOLEAN
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_user_created BOOLEAN := FALSE;
    v_session_created BOOLEAN := FALSE;
    v_cap BIGINT;
    v_owner TEXT;
    v_holder TEXT;
    v_pending TEXT;
    v_session_fence BIGINT;
    v_now_ms BIGINT;
BEGIN
    -- Ruled out by the rows without a lock: fall back at once.
    IF EXISTS (SELECT 1 FROM ag_turns
               WHERE session_id = p_session_id AND client_request_id = p_client_request_id)
        OR EXISTS (SELECT 1 FROM ag_sessions
                   WHERE session_id = p_session_id AND (user_id <> p_user_id
                     OR holder_turn_id IS NOT NULL OR pending_turn_id IS NOT NULL
                     OR fence >= p_fence))
    THEN
        RETURN FALSE;
    END IF;

    PERFORM set_config('lock_timeout', p_lock_timeout, TRUE);

    -- The user's row, locked (created on first use).
    SELECT max_turns INTO v_cap FROM ag_users WHERE user_id = p_user_id FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO ag_users (user_id) VALUES (p_user_id) ON CONFLICT (user_id) DO NOTHING;
        IF NOT FOUND THEN
            PERFORM set_config('synchronous_commit', 'off', TRUE);
            RETURN FALSE;
        END IF;
        v_user_created := TRUE;
    END IF;

    -- Then the session's row, locked (created on first use, bound to the caller).
    SELECT user_id, holder_turn_id, pending_turn_id, fence
        INTO v_owner, v_holder, v_pending, v_session_fence
        FROM ag_sessions WHERE session_id = p_session_id FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms)
            VALUES (p_session_id, p_user_id, 0,
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT)
            ON CONFLICT (session_id) DO NOTHING;
        IF FOUND THEN
            v_session_created := TRUE;
            v_owner := p_user_id;
            v_session_fence := 0;
        END IF;
    END IF;

    v_now_ms := floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT;

    IF v_owner IS NULL  -- the session was created meanwhile by another begin
        OR v_owner <> p_user_id
        OR v_holder IS NOT NULL
        OR v_pending IS NOT NULL
        OR v_session_fence >= p_fence
        OR v_cap < 0 OR v_cap > 4294967295
        OR EXISTS (SELECT 1 FROM ag_turns
                   WHERE session_id = p_session_id AND client_request_id = p_client_request_id)
        OR (SELECT COUNT(*) FROM ag_sessions
            WHERE user_id = p_user_id AND lease_expires_at_ms > v_now_ms)
           >= COALESCE(v_cap, p_default_cap)
    THEN
        IF v_session_created THEN
            DELETE FROM ag_sessions WHERE session_id = p_session_id;
        END IF;
        IF v_user_created THEN
            DELETE FROM ag_users WHERE user_id = p_user_id;
        END IF;
        PERFORM set_config('synchronous_commit', 'off', TRUE);
        RETURN FALSE;
    END IF;

    -- The grant (the full path's statement for a new turn without a
    -- confirmation, with the lease held by the layer): holder, token digest
    -- and the caller's fence on the session's row, no expiry, then the turn
    -- under that fence.
    UPDATE ag_sessions SET holder_turn_id = p_turn_id, lease_token_hash = p_token_hash,
        fence = p_fence, lease_expires_at_ms = NULL, updated_at_ms = v_now_ms
        WHERE session_id = p_session_id;
    INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint,
        state, attempt, fence, created_at_ms, updated_at_ms, payload)
        VALUES (p_turn_id, p_session_id, p_user_id, p_client_request_id, p_fingerprint,
        'running', 1, p_fence, v_now_ms, v_now_ms, p_payload);
    RETURN TRUE;
END;
$$;
