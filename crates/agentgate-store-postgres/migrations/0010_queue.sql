-- agentgate schema v10 (PostgreSQL): a session's queue (on_busy: enqueue
-- and supersede).
--
-- A queued turn is a turn row in state 'queued' with its place in the
-- session's queue in queue_seq (NULL for every other turn; a start of the
-- head clears it). The partial index serves the head, the length and the
-- positions, all per session.
--
-- A new request must never jump a queue, so the one-call begins of
-- migrations 0006 and 0009 now also fall back ("decide under the locks of
-- the full path") while the session has a queued turn; they are replaced
-- with that one condition added, in the early check and under the locks,
-- otherwise unchanged. The column is nullable, so the previous release's
-- statements still run during a rolling upgrade; but a node of that
-- release knows neither the 'queued' state nor the rule that a queue is
-- never jumped: upgrade every node before any caller enqueues.
ALTER TABLE ag_turns ADD COLUMN queue_seq BIGINT;
CREATE INDEX ag_turns_queue ON ag_turns (session_id, queue_seq) WHERE queue_seq IS NOT NULL;

CREATE OR REPLACE FUNCTION ag_begin_new(
    p_session_id TEXT,
    p_user_id TEXT,
    p_client_request_id TEXT,
    p_turn_id TEXT,
    p_token_hash TEXT,
    p_fingerprint TEXT,
    p_payload TEXT,
    p_lease_ttl_ms BIGINT,
    p_default_cap BIGINT,
    p_lock_timeout TEXT
) RETURNS BIGINT
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_user_created BOOLEAN := FALSE;
    v_session_created BOOLEAN := FALSE;
    v_cap BIGINT;
    v_owner TEXT;
    v_holder TEXT;
    v_pending TEXT;
    v_now_ms BIGINT;
    v_fence BIGINT;
BEGIN
    -- A begin whose rows already rule the common case out (a repeat of a
    -- request, a held session: a storm of them) falls back before taking
    -- any lock, so it neither queues for the user's row twice nor commits
    -- a transaction. Read without locks, this only ever falls back; the
    -- grant rests on the same checks repeated under the locks.
    IF EXISTS (SELECT 1 FROM ag_turns
               WHERE session_id = p_session_id AND client_request_id = p_client_request_id)
        OR EXISTS (SELECT 1 FROM ag_turns WHERE session_id = p_session_id AND queue_seq IS NOT NULL)
        OR EXISTS (SELECT 1 FROM ag_sessions
                   WHERE session_id = p_session_id AND (user_id <> p_user_id
                     OR holder_turn_id IS NOT NULL OR pending_turn_id IS NOT NULL))
    THEN
        RETURN NULL;
    END IF;

    PERFORM set_config('lock_timeout', p_lock_timeout, TRUE);

    -- The user's row, locked (created on first use).
    SELECT max_turns INTO v_cap FROM ag_users WHERE user_id = p_user_id FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO ag_users (user_id) VALUES (p_user_id) ON CONFLICT (user_id) DO NOTHING;
        IF NOT FOUND THEN
            -- Another begin created it meanwhile: no lock held, nothing
            -- written (the commit need not wait, as below).
            PERFORM set_config('synchronous_commit', 'off', TRUE);
            RETURN NULL;
        END IF;
        v_user_created := TRUE;
    END IF;

    -- Then the session's row, locked (created on first use, bound to the caller).
    SELECT user_id, holder_turn_id, pending_turn_id INTO v_owner, v_holder, v_pending
        FROM ag_sessions WHERE session_id = p_session_id FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO ag_sessions (session_id, user_id, fence, updated_at_ms)
            VALUES (p_session_id, p_user_id, 0,
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT)
            ON CONFLICT (session_id) DO NOTHING;
        IF FOUND THEN
            v_session_created := TRUE;
            v_owner := p_user_id;
        END IF;
    END IF;

    v_now_ms := floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT;

    -- Every condition of a new start; anything else falls back. A cap
    -- outside 0..=u32::MAX is corrupt: the full path reports it.
    IF v_owner IS NULL  -- the session was created meanwhile by another begin
        OR v_owner <> p_user_id
        OR v_holder IS NOT NULL
        OR v_pending IS NOT NULL
        OR EXISTS (SELECT 1 FROM ag_turns WHERE session_id = p_session_id AND queue_seq IS NOT NULL)
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
        -- Nothing of this transaction matters (its row locks, an insert
        -- deleted again), so its commit need not wait for the WAL flush
        -- while the user's row stays locked: were it lost in a crash, the
        -- tables would read the same.
        PERFORM set_config('synchronous_commit', 'off', TRUE);
        RETURN NULL;
    END IF;

    -- The grant (the full path's statement for a new turn without a
    -- confirmation): holder, token digest, a fence from the sequence and
    -- the expiry on the session's row, then the turn under that fence.
    UPDATE ag_sessions SET holder_turn_id = p_turn_id, lease_token_hash = p_token_hash,
        fence = nextval('ag_fence_seq'), lease_expires_at_ms = v_now_ms + p_lease_ttl_ms,
        updated_at_ms = v_now_ms
        WHERE session_id = p_session_id
        RETURNING fence INTO STRICT v_fence;
    INSERT INTO ag_turns (turn_id, session_id, user_id, client_request_id, fingerprint,
        state, attempt, fence, created_at_ms, updated_at_ms, payload)
        VALUES (p_turn_id, p_session_id, p_user_id, p_client_request_id, p_fingerprint,
        'running', 1, v_fence, v_now_ms, v_now_ms, p_payload);
    RETURN v_fence;
END;
$$;

CREATE OR REPLACE FUNCTION ag_begin_layered(
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
        OR EXISTS (SELECT 1 FROM ag_turns WHERE session_id = p_session_id AND queue_seq IS NOT NULL)
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
        OR EXISTS (SELECT 1 FROM ag_turns WHERE session_id = p_session_id AND queue_seq IS NOT NULL)
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

