/*===- moec_status.h - What moec's C APIs return ------------------*- C -*-===*
 *
 * Every call of moec's C APIs that can fail (the runtime's moec_runtime.h
 * and RuntimeMpi.h, the compiler library's moec.h) returns a moec_status_t:
 * NULL (MOEC_OK) for success, else an error that the caller owns. It holds
 * a code (moec_status_code(): MOEC_ERROR, or a kind a caller may act on, such
 * as MOEC_OVER_CAPACITY) and a message for a person (moec_status_message),
 * and is freed once with moec_status_free. Nothing else is written when a
 * call fails. Like IREE's iree_status_t; the C face of base/Status.h.
 *
 * Compiles as C or C++ and includes nothing else of moec's.
 *
 *===---------------------------------------------------------------------===*/

#ifndef MOEC_BASE_MOEC_STATUS_H
#define MOEC_BASE_MOEC_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/** An error the caller owns, or NULL for success. */
typedef struct moec_status_object *moec_status_t;

/** Success. */
#define MOEC_OK ((moec_status_t)0)

/** What kind of error a status is (the values of moec::StatusCode). */
typedef enum moec_status_code_e {
  MOEC_STATUS_OK = 0,    /**< success: a NULL status */
  MOEC_ERROR = 1,        /**< anything else: the message says what */
  MOEC_OVER_CAPACITY = 2 /**< a routing needs more capacity than the binary has */
} moec_status_code_t;

/** The kind of `status` (MOEC_STATUS_OK for NULL). */
moec_status_code_t moec_status_code(moec_status_t status);

/** The message of `status` ("" for NULL); valid until it is freed. */
const char *moec_status_message(moec_status_t status);

/** Frees `status`; NULL does nothing. Once per status. */
void moec_status_free(moec_status_t status);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOEC_BASE_MOEC_STATUS_H */
