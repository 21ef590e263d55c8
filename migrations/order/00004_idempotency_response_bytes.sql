-- +goose Up
-- A replay of an Idempotency-Key must get the first response byte for byte,
-- and jsonb does not keep bytes: it reorders keys and changes spacing. From
-- here on the response is kept as the bytes that were sent.
--
-- Rows stored before this migration have lost their bytes already: they
-- keep jsonb's text and are marked response_normalized, and the service
-- re-encodes them the way it encoded them first (encoding/json of the
-- order), which gives the original bytes back. Existing rows take the
-- column's first default (true); every later row its second (false).
ALTER TABLE idempotency_keys
    ALTER COLUMN response TYPE bytea USING convert_to(response::text, 'UTF8'),
    ADD COLUMN response_normalized boolean NOT NULL DEFAULT true;
ALTER TABLE idempotency_keys ALTER COLUMN response_normalized SET DEFAULT false;

-- +goose Down
ALTER TABLE idempotency_keys
    ALTER COLUMN response TYPE jsonb USING convert_from(response, 'UTF8')::jsonb,
    DROP COLUMN response_normalized;
